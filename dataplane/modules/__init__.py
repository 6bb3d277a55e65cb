"""Server modules: one per message family; each registers its handlers with the server."""
