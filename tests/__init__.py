"""qfserve test suite: mirrors the packages; CPU only, nothing downloaded."""
