"""What the API and the CLI share, in the caller's process, over the store only:

- ``deployments``: the one way to propose, deploy, roll back and cancel;
- ``queries``: read models (model summary, profile, trials and front, busy intervals);
- ``timeline``: latency over time with deployment markers, deployment outcomes;
- ``suggest``: the one suggestion engine (API profile and ``pgc profile``).
"""
