"""h2o-chat: entry point. The chat UI lands with the app issue; for now this prints how to use
the library."""

import sys

USAGE = """h2o-chat: the chat UI is not built yet.
Use the library directly:
    from h2o_chat import H2OCache
    cache = H2OCache(model, policy="h2o", budget=256, n_sink=4, n_recent=128)
    model.generate(input_ids, cache=cache, max_new_tokens=200)"""

if __name__ == "__main__":
    print(USAGE)
    sys.exit(0)
