"""MuonClip for JAX: Muon as Optax transforms, QK-Clip over Flax parameter pytrees."""

from ._clip import MultiStepsMaxLogitsState as MultiStepsMaxLogitsState
from ._clip import multi_steps as multi_steps
from ._clip import GQALayout as GQALayout
from ._clip import MLALayout as MLALayout
from ._clip import Projection as Projection
from ._clip import QKClipState as QKClipState
from ._clip import qk_clip_transform as qk_clip_transform
from ._clip import init_max_logits as init_max_logits
from ._clip import qk_clip as qk_clip
from ._clip import qk_clip_stats as qk_clip_stats
from ._clip import reduce_max_logits as reduce_max_logits
from ._clip import check_opt_state as check_opt_state
from ._muon import muon as muon
from ._muon import muon_adamw as muon_adamw
from ._muon import ScaleByMuonState as ScaleByMuonState
from ._muon import scale_by_muon as scale_by_muon
from ._muon import upgrade_opt_state as upgrade_opt_state
from ._muon import attention_matrix_axes as attention_matrix_axes
from ._muon import logical_matrix_axes as logical_matrix_axes
from ._muon import muon_labels as muon_labels
from ._muonclip import muonclip as muonclip
from ._orthogonalize import newton_schulz as newton_schulz
from ._util import MatrixAxes as MatrixAxes
from . import sharding as sharding
from . import training as training

__version__ = "0.1.0"
