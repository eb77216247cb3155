"""The pipeline as one service: its endpoint (the front door a client sends a request to, and
gets the last stage's output from) and the protocol by which each stage that takes a request
reports to it (protocol.py, link.py). Imports nothing else of omni_runtime."""
