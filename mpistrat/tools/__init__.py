"""Tools built on the library: ``mpistrat info | bench | plot`` and the GPU and check benchmarks.

They depend on the library; the library (``mpistrat`` outside ``tools``) never imports them.
"""
