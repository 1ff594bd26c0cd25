"""The steps of ``tierflow.fit``, in its order: check the request, start the model where it
waits (``start.py``), profile and plan its step (``profile_step.py``), and build the drop-in
module that runs the plan (``build.py``)."""
