"""omnifeed.loader.decode: per-modality decoders and their configs, meta fields by type, DALI, decode worker
processes."""

from ._common import REASONS, DecodeError, as_numpy, function_name, is_torch_tensor, user_code_error
from ._config import AudioDecodeConfig, DecodeConfig, ImageDecodeConfig, TextDecodeConfig, VideoDecodeConfig
from ._meta import ColumnKind, decode_meta
from ._process_tasks import decode_in_process
from ._registry import make_decoder
from ._text import follow_index_tokenizer
from ._worker_procs import WorkerDied, WorkerProcesses, child_process_type

__all__ = [
    "AudioDecodeConfig",
    "ColumnKind",
    "DecodeConfig",
    "DecodeError",
    "ImageDecodeConfig",
    "REASONS",
    "TextDecodeConfig",
    "VideoDecodeConfig",
    "WorkerDied",
    "WorkerProcesses",
    "as_numpy",
    "child_process_type",
    "decode_in_process",
    "decode_meta",
    "follow_index_tokenizer",
    "function_name",
    "is_torch_tensor",
    "make_decoder",
    "user_code_error",
]
