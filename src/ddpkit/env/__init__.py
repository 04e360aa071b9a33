"""Where a rank runs: the launcher's environment read as data (``detect``, pure), the process
group set up from it (``dist``), Slurm's and Kubernetes' variables, the machine's description."""
