"""The app around the engine: the ``graphstep`` command line (``demo | profile | bench``), the demo's
training run and report, the built-in model and corpus (``graphstep.app.models``) and profiling.

The core (everything in graphstep/ outside this folder) never imports it: ``import graphstep`` loads
neither this package nor its optional dependencies (matplotlib, from the ``app`` extra:
``pip install 'graphstep[app]'``). The app uses the engine through its public API only.
"""
