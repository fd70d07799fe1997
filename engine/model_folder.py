"""What an engine reads from a local model folder at start, overlapped where it can be.

``EngineCore`` opens the folder once, first thing: the checkpoint's files start going
into the page cache (engine.models.checkpoint_prefetch) while the model config is read
(phase ``config``: mostly importing transformers), and the tokenizer loads on a thread
of its own while the weights are read. On an 8B start these were seconds of a replica's
time to ready spent one after another (issue 33).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.models.checkpoint_prefetch import CheckpointPrefetch
from engine.startup_phases import StartupPhases


class ModelFolder:
    """Created by :meth:`open` on the thread that starts the engine; ``config`` is the
    model's config, :meth:`weights_read` is called once the weights are in place and
    :meth:`tokenizer` once, where the engine needs it."""

    def __init__(self, model_dir: Path, config: ModelConfig, prefetch: CheckpointPrefetch | None) -> None:
        self.model_dir = model_dir
        self.config = config
        self.prefetch = prefetch
        self._tokenizer: Future[Any] | None = None

    @classmethod
    def open(cls, model_dir: Path, startup: StartupPhases, *, prefetch_weights: bool) -> ModelFolder:
        """Check the folder, start the prefetch (``prefetch_weights``: the weights will be
        read from it), read the config (ValueError for a missing or unknown one) and start
        loading the tokenizer."""
        if not model_dir.is_dir():
            raise ValueError(f"model folder {str(model_dir)!r} does not exist")
        prefetch = CheckpointPrefetch.start(model_dir) if prefetch_weights else None
        try:
            with startup.phase("config"):
                config = ModelConfig.from_dir(model_dir)
        except BaseException:
            if prefetch is not None:
                prefetch.stop()
            raise
        folder = cls(model_dir, config, prefetch)
        # after the config: transformers is imported by now, so the thread's imports never
        # race the main thread's first import of it
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        folder._tokenizer = pool.submit(_load_tokenizer, model_dir)
        pool.shutdown(wait=False)
        return folder

    def weights_read(self) -> None:
        """The weights are in place (or failed): no more prefetch advice."""
        if self.prefetch is not None:
            self.prefetch.stop()

    def tokenizer(self) -> Any:
        """The folder's Hugging Face tokenizer (waits for its thread; re-raises its error)."""
        if self._tokenizer is None:
            raise RuntimeError("ModelFolder.tokenizer() before open()")
        return self._tokenizer.result()


def _load_tokenizer(model_dir: Path) -> Any:
    from engine.prompts import load_tokenizer

    return load_tokenizer(str(model_dir))
