"""Moved to snapkv_lab.compression.generation (2026-11-28), the one answer engine: an alias that warns, for one release.
`answer_runs` yields GenerationResult (its former AnswerRun: `question` is now `question_index`, the state's kept
positions and selection time are the result's own)."""

from ..core.moved import moved

moved(__name__, "snapkv_lab.compression.generation")
