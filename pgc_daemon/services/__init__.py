"""What the API and the CLI share: ``deployments`` (the one way to propose, deploy, roll back
and cancel) and ``queries`` (read models of status, profile, front and timeline). These run in
the caller's process and only read and write the store."""
