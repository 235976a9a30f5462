"""kauldron's shape annotations as gemma 4.0.1 imports them (``kauldron.ktyping``)."""

from .typing import Array, Bool, Int  # noqa: F401
