"""How the API tests reach the servers tests/api/conftest.py shares among their modules: the keyed server's API key,
the name both serve the tiny model as, and the short-context server's context in tokens."""

KEY = "test-key"
MODEL = "vlmcap-tiny"
SHORT_CONTEXT = 96
