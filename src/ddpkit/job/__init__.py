"""The ``ddpkit train`` job: its config (:mod:`.config`), the checks before launching
(:mod:`.check`), the builders (:mod:`.build`), the per-rank job (:mod:`.train`), how it is started
(:mod:`.start`), and the built-in models and datasets (:mod:`.models`, :mod:`.datasets`).

Example::

    from ddpkit.job.config import TrainConfig
    from ddpkit.job.start import start
    start(TrainConfig(epochs=2, output="runs/quick"))
"""
