"""MuonClip for JAX: Muon as Optax transforms, QK-Clip over Flax parameter pytrees."""

from ._accumulation import MultiStepsMaxLogitsState as MultiStepsMaxLogitsState
from ._multi_steps import multi_steps as multi_steps
from ._alias import muon as muon
from ._alias import muon_adamw as muon_adamw
from ._layouts import GQALayout as GQALayout
from ._layouts import MLALayout as MLALayout
from ._projection import Projection as Projection
from ._muon import ScaleByMuonState as ScaleByMuonState
from ._muon import scale_by_muon as scale_by_muon
from ._muonclip import QKClipState as QKClipState
from ._muonclip import muonclip as muonclip
from ._muonclip import qk_clip_transform as qk_clip_transform
from ._newton_schulz import newton_schulz as newton_schulz
from ._qk_clip import init_max_logits as init_max_logits
from ._qk_clip import qk_clip as qk_clip
from ._qk_clip import qk_clip_stats as qk_clip_stats
from ._max_logits import reduce_max_logits as reduce_max_logits
from ._matrix_axes import MatrixAxes as MatrixAxes
from ._attention_axes import attention_matrix_axes as attention_matrix_axes
from ._routing import logical_matrix_axes as logical_matrix_axes
from ._labels import muon_labels as muon_labels
from ._state_checks import check_opt_state as check_opt_state
from . import sharding as sharding
from . import training as training

__version__ = "0.1.0"
