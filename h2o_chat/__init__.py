"""h2o-chat: a local chat whose KV cache is managed by H2O (Heavy-Hitter Oracle)."""

from .cache import H2OCache
from .model import ModelLoadError, load_model
from .policy import CacheConfig
from .session import ChatSession

__all__ = ["H2OCache", "CacheConfig", "ChatSession", "load_model", "ModelLoadError"]
