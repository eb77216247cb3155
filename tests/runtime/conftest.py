import os
import sys

# Test helpers next to the tests (otlp_receiver) are imported by name.
sys.path.insert(0, os.path.dirname(__file__))
