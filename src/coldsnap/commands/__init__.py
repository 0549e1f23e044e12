"""Sub-commands of the ``coldsnap`` CLI; each module has ``register(subparsers)``."""
