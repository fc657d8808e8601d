"""Where parameters and optimizer state live, beyond a replica on every worker: parameter servers
(``px.ParameterServer``), central storage (``px.CentralStorage``) and sharding (``px.Sharded``); and
replicas that synchronize every few steps over slow links (``px.LocalSGD``, ``px.DiLoCo``)."""
