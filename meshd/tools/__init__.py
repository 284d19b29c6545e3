"""Commands: the ``meshd`` and ``meshctl`` CLIs, the local demo, the systemd unit and notify."""
