"""What cocoweave keeps on disk: files written whole or not at all (`atomic`), the state folders it trusts (`statedir`:
`./.cocoweave` and the code cache's), and the cache of generated source (`codecache`)."""
