"""Commands: the ``meshd`` and ``meshctl`` CLIs (``meshctl batch`` in batchctl), the local
demo, the systemd unit and notify."""
