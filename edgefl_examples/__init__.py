"""Worked examples: the runtime on real data a registry package ships, with a user's model.

- :mod:`edgefl_examples.wearable`: activity recognition from a wrist-worn sensor's
  accelerometer and gyroscope (aeon's BasicMotions), a 1-D convolutional network on
  ``(6, 100)`` windows;
- :mod:`edgefl_examples.tabular`: a diagnosis from 30 measured features
  (scikit-learn's breast-cancer data), a multilayer perceptron on ``(30,)`` vectors.

Each module has a model factory for ``--model`` (``edgefl_examples.wearable:build_cnn``,
``edgefl_examples.tabular:build_mlp``) and writes its data as an ``npz`` dataset
(``python -m edgefl_examples.wearable --out motions.npz``) that the sim, ``python -m sim
partition`` and the devices read. The data packages are the ``examples`` extra (``pip
install "edgefl[examples]"``); the models need torch only. docs/examples.md gives the
overview, and docs/example-wearable.md and docs/example-tabular.md walk through each.
"""
