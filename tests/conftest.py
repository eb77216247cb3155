import os
import sys

# Helpers shared by the test directories (procs: real processes for e2e tests) import by name.
sys.path.insert(0, os.path.dirname(__file__))
