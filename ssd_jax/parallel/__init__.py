"""Parallelism: logical axes and sharding rules (:mod:`.sharding`), and placing models, caches and
small arrays on meshes (:mod:`.placement`)."""
