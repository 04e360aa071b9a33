"""When a run goes wrong: crash reports that name the rank, the hang heartbeat, and stop signals
(SIGTERM / SIGUSR1) turned into a checkpoint and a clean exit."""
