"""Training state on disk: one verified file per checkpoint, saved in the background, kept per run.

    from kiln.checkpoint import save, load
    save("step-100.kiln", trainer.state_dict())      # atomic: temp file, fsync, rename
    state = load("step-100.kiln")                     # checksum verified, or CheckpointError

`format` is the file (safetensors + JSON metadata + sha256), `async_save` the background writer,
`run_folder` a run's last K checkpoints and its pointer to the newest good one, `hf` the
interchange with Hugging Face GPT-2 folders.
"""

from kiln.checkpoint.async_save import AsyncSaver, HostStaging
from kiln.checkpoint.format import FORMAT_VERSION, CheckpointError, describe, load, save
from kiln.checkpoint.hf import export_hf, import_hf
from kiln.checkpoint.run_folder import CheckpointFolder

__all__ = ["AsyncSaver", "HostStaging", "FORMAT_VERSION", "CheckpointError", "describe", "load", "save",
           "export_hf", "import_hf", "CheckpointFolder"]
