"""What a run leaves on disk and how it is read back: result tables and their pandas helpers (``results``), reports
(``report``), the run-directory lifecycle (``rundir``), the ``raysim runs`` listing (``runs``) and checkpoints
(``checkpoints``)."""
