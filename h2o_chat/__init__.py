"""h2o-chat: a local chat whose KV cache is managed by H2O (Heavy-Hitter Oracle)."""

from .cache.config import CacheConfig
from .cache.h2o import H2OCache
from .chat.conversation import CHOICES, Conversation, Message, Sampling, Settings
from .chat.session import ChatSession, GenerationError
from .models.load import ModelLoadError, load_model

__all__ = ["H2OCache", "CacheConfig", "ChatSession", "Conversation", "Message", "Sampling", "Settings", "CHOICES",
           "GenerationError", "load_model", "ModelLoadError"]
