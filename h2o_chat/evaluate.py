"""`python -m h2o_chat.evaluate`: the command earlier versions documented, kept working; the
evaluations live in h2o_chat.bench.evaluate (also installed as `h2o-chat-eval`)."""

from .bench.evaluate import main

if __name__ == "__main__":
    main()
