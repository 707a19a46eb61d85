"""Native helpers the library may use where they compile, with the same behaviour in Python where not:
param_checks (the pre-step checks' per-param reads), built by build.py."""
