"""The fault machinery: when a rank dies or hangs, every rank stops with one error naming it.

- ``watchdog``: :class:`~.watchdog.CollectiveWatchdog`, one per rank from the grid's creation to teardown
  (heartbeats, the abort and the verdict over the c10d store; the exit guard), and the collective timeout;
- ``collective_record``: per process group, the last collective this rank entered, completed and saw fail
  (PyTorch's flight recorder, or our own record of the calls), and the injected-hang test hook, which the test
  harness installs (``install_hang``; library code never reads it from the environment);
- ``collective_diagnosis``: pure, from every rank's record to one verdict (dead, raised, hung, stuck);
- ``processes``: a worker that dies with its parent, and ending the processes a launcher started.

Every torch.distributed private these touch is in :mod:`shardline.plugins.torch_compat`.

Torch only: no Lightning, no DeepSpeed. The strategy (``shardline.plugins.lightning.strategy``) starts and stops
the watchdog.
"""
