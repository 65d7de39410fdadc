"""The launcher: boot-or-restore decision, a worker process (in a gVisor sandbox or not)
that holds the engine, and the client that talks to it over stdio frames."""
