"""Optional integrations, each a plugin registered through the ``engine.plugins`` entry points like
third-party code; one whose library is missing is refused with the reason (``engine plugins``)."""
