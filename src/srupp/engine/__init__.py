"""The decoding engine behind ``srupp generate`` and ``srupp serve``.

    engine.py    Engine: slots, prompts read in chunks, one batched step for all streams
    text.py      TextDecoder (text as tokens come, partial characters held back) and
                 StopMatcher (stop strings across token boundaries)
    sessions.py  SessionStore: conversations kept between requests and across restarts
"""

from .engine import (ABORT, DEFAULT_WINDOW, LENGTH, STOP, Engine, EngineClosed, Event,
                     QueueFull, Sampling, SessionBusy, Stream, model_fingerprint)
from .sessions import Session, SessionStore, check_session_id
from .text import StopMatcher, TextDecoder, check_stops

__all__ = ["Engine", "Sampling", "Stream", "Event", "QueueFull", "EngineClosed", "SessionBusy",
           "STOP", "LENGTH", "ABORT", "DEFAULT_WINDOW", "model_fingerprint", "Session",
           "SessionStore", "check_session_id", "TextDecoder", "StopMatcher", "check_stops"]
