"""Moved to snapkv_lab.pressure.pressure_plots and snapkv_lab.views.palette (2026-11-28): an alias that warns, for one
release."""

from ..core.moved import moved

moved(__name__, "snapkv_lab.pressure.pressure_plots", "snapkv_lab.views.palette")
