"""Models of the edge FL runtime: classifiers, generators and state conversion.

Classifiers split into ``features`` and ``head`` (see :class:`Classifier`) and are built
by name with :func:`build_classifier` (a registered name, or a user's factory by its
import path, :mod:`models.imported`); generators with :func:`build_generator`.
:func:`state_arrays` and :func:`load_state_arrays` convert a module's state to and from
the ``dict[str, numpy.ndarray]`` that :mod:`protocol` puts on the wire. Modules take a
device as a parameter; nothing here keeps global state, and only
:mod:`models.datafiles` (public datasets' files) does I/O.
"""

from __future__ import annotations

from models.classifiers import (
    DEFAULT_IMAGE_SIZE,
    DEFAULT_IN_CHANNELS,
    DEFAULT_NUM_CLASSES,
    Classifier,
    ClassifierConfig,
    square_images,
)
from models.errors import (
    ModelConfigError,
    ModelError,
    ModelInputError,
    StateMismatchError,
    UnknownModelError,
)
from models.generators import (
    ImageGenerator,
    ImageGeneratorConfig,
    LatentGenerator,
    LatentGeneratorConfig,
    SampleGenerator,
    SampleGeneratorConfig,
    build_sample_generator,
    sample_generator_config,
)
from models.imported import ImportedClassifier, lacks_split
from models.lenet import LeNet5, LeNet5Config
from models.registry import (
    build_classifier,
    build_generator,
    classifier_class,
    classifier_names,
    classifier_problem,
    generator_kinds,
    seeded,
)
from models.resnet import FEDDF_RESNET8_WIDTHS, FEDKF_RESNET8_WIDTHS, ResNet8, ResNet8Config
from models.small import MLP, FedGenCNN, FedGenCNNConfig, MLPConfig
from models.state import (
    StateSubset,
    load_state_arrays,
    state_arrays,
    state_shapes,
    subset_names,
)

__all__ = [
    # classifiers
    "Classifier",
    "ClassifierConfig",
    "DEFAULT_IMAGE_SIZE",
    "DEFAULT_IN_CHANNELS",
    "DEFAULT_NUM_CLASSES",
    "FEDDF_RESNET8_WIDTHS",
    "FEDKF_RESNET8_WIDTHS",
    "FedGenCNN",
    "FedGenCNNConfig",
    "ImportedClassifier",
    "LeNet5",
    "LeNet5Config",
    "MLP",
    "MLPConfig",
    "ResNet8",
    "ResNet8Config",
    # generators
    "ImageGenerator",
    "ImageGeneratorConfig",
    "LatentGenerator",
    "LatentGeneratorConfig",
    "SampleGenerator",
    "SampleGeneratorConfig",
    "build_sample_generator",
    "sample_generator_config",
    # registry
    "build_classifier",
    "build_generator",
    "classifier_class",
    "classifier_problem",
    "classifier_names",
    "generator_kinds",
    "lacks_split",
    "seeded",
    "square_images",
    # state
    "StateSubset",
    "load_state_arrays",
    "state_arrays",
    "state_shapes",
    "subset_names",
    # errors
    "ModelConfigError",
    "ModelError",
    "ModelInputError",
    "StateMismatchError",
    "UnknownModelError",
]
