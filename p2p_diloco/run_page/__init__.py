"""A run's page: the swarm and its model over time, served over HTTP (``p2p-diloco status --serve``,
``p2p-diloco bootstrap --page-port``).

* :mod:`.history` turns each reading of the run's status records into a point of bounded series;
* :mod:`.render` writes the page as HTML with server-side SVG plots (no script, font or style from
  elsewhere: it works offline), every peer-supplied string escaped;
* :mod:`.server` reads the DHT every few seconds and serves ``/`` and ``/api/status``, read-only.
"""
