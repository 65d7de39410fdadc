"""Tier-A engine snapshots: a JSON manifest over content-addressed tensor chunks and runtime
files, kept in a local directory or an S3 bucket, restored with read, verify and copy overlapped.

Modules: ``image`` (manifest format, chunking), ``key`` (compatibility key), ``store``
(``LocalStore``, ``S3Store``, ``open_store``), ``publish`` (write an image), ``restore`` (read
one back), ``boot`` (the engine's restore-or-cold-boot decision), ``cli`` (``warmboot snapshot``).
"""
