"""Where parameters and optimizer state live, beyond a replica on every worker: parameter servers
(``px.ParameterServer``) and central storage (``px.CentralStorage``)."""
