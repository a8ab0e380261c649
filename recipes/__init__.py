"""Reference models, data and training recipes used to exercise the compiler."""
