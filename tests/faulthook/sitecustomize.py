"""Imported by Python at the start of every process whose PYTHONPATH holds this folder (tests/faultkit.py's
hook_env puts it there): installs the faults that the environment describes, in that process alone."""
import os
import sys

if os.environ.get("DSFIX_TEST_FAULTS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import faultkit

    faultkit.install_from_env()
