"""h2o-chat: a local chat whose KV cache is managed by H2O (Heavy-Hitter Oracle)."""

from .cache import H2OCache
from .conversation import CHOICES, Conversation, Message, Sampling, Settings
from .model import ModelLoadError, load_model
from .policy import CacheConfig
from .session import ChatSession, GenerationError

__all__ = ["H2OCache", "CacheConfig", "ChatSession", "Conversation", "Message", "Sampling", "Settings", "CHOICES",
           "GenerationError", "load_model", "ModelLoadError"]
