"""downpour: an asynchronous, DistBelief-style ("Downpour SGD") parameter server for TensorFlow.

The public API is what a model plugin writes against::

    import downpour

    def my_model() -> downpour.ModelSpec:
        return downpour.ModelSpec(name="mine", build=build, load_data=load)

``import downpour`` does not import TensorFlow; the modules that need it
(``downpour.model.build``, ``downpour.server``, ``downpour.worker``) import it themselves.
"""

from downpour.inputs.context import InputContext
from downpour.inputs.data import Dataset
from downpour.spec import ModelSpec

__version__ = "0.1.0"

__all__ = ["Dataset", "InputContext", "ModelSpec", "__version__"]
