"""The control plane: finding peers, keeping links to them, electing the supernode,
placing layers, negotiating plans, and the model files each peer needs."""
