"""kauldron's shape annotations (``Int['B L']``) as gemma imports them (gemma 3.3.0): annotations only."""


class _Annotation:
  def __class_getitem__(cls, shape):
    return cls


Array = Bool = Int = _Annotation
