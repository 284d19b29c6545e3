"""Wire messages between meshd peers and the one codec that encodes them."""
