"""The optimizer: what ``pgc serve`` runs beside the API. ``daemon`` ticks, ``schedule``
decides (purely) when a model needs a search, ``workers`` spawns and reaps the search worker
processes, and ``search`` is what runs inside a worker."""
