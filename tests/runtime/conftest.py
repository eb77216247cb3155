import os
import sys

# The scheduler harness is imported by name from the tests next to it.
sys.path.insert(0, os.path.dirname(__file__))
