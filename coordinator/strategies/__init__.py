"""Server-side strategies, one module each, chosen by name from a registry.

=============  ===================================================================
name           server side
=============  ===================================================================
fedavg         ACA = sample-weighted average of the round's on-time updates; with
               ``sharing head`` of their heads alone (features stay on the devices)
fedprox        as fedavg; devices add (mu/2)*||w - w_global||^2 (mu in the task)
fedavg_oca     as fedavg, plus the OCA model over every device's latest update
fedkf          FedKF: ACA and OCA as fedavg_oca; downlink ``dual`` sends ACA as the
               student and OCA as the teacher, ``single`` (FedKF-) the ACA alone;
               devices distil through a local image generator
fedgen         FedGen: averages what devices share (``full`` model or ``head`` only)
               and trains a conditional latent generator against the devices' heads
               each round; sends the generator and the label prior with the model
feddf          FedDF: each group's model starts from the average of its group's
               updates and is distilled from the ensemble of every update, whatever
               its architecture, on the server's unlabeled proxy data or (``distill_data
               generator``) on images of a generator trained against the ensemble
dense          DENSE, one-shot: one round, one upload per device; the server trains
               an image generator against the ensemble of every update and distils
               the ensemble into a fresh model per group on its images (no data)
=============  ===================================================================

Modules:

- ``base``: :class:`~coordinator.strategies.base.Strategy` and what it exchanges with
  the round engine (``Contribution``, ``Aggregated``, ``NothingToAggregate``);
- ``registry``: the strategies by name, ``build_strategy``;
- one module per strategy, named after it (``fedavg`` holds ``FedAvg``), with its server
  step; ``ensemble`` and ``sample_generation`` hold what FedDF and DENSE share;
- ``options`` and the ``NAME_settings`` modules: the fleet settings one strategy reads
  (FedKF's, FedDF's, DENSE's), light to import: the fleet's configuration
  (:mod:`coordinator.config`) mixes them in without importing any strategy.

This package's own namespace stays empty, so that importing a settings module loads
no strategy.
"""
