"""The messages of the ``hvd_compress`` logger, recorded where a test body runs."""

import logging


def record_messages():
    """A list that receives the message of every record the ``hvd_compress`` logger handles
    from now on in this process (the wrappers' choices and warnings, logged once each)."""
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("hvd_compress").addHandler(handler)
    return messages
