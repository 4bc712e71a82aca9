"""The shared-memory rings between the processes (writer, readers, segment layout, waiting) and
the msgpack codec of `vx.messages`."""
