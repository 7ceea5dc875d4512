"""The serving side of specserve, by what each part holds:

* :mod:`cluster.cli`: the ``specserve`` command; :mod:`cluster.app`: the public Serve import
  path ``cluster.app:build_app``;
* :mod:`cluster.config`: the deployment's ``args`` (the Serve YAML), its generated reference and
  the placement of models on workers (:mod:`cluster.config.placement`);
* :mod:`cluster.serving`: the serving processes: the Serve ingress (HTTP and gRPC), the model
  group's bring-up, coordinator streams, metrics, the API key and ``specserve serve``;
* the protocols: :mod:`cluster.schemas` (HTTP request bodies, chat prompts, bodies to
  generation requests), :mod:`cluster.responses` (OpenAI response bodies and streams) and
  :mod:`cluster.grpc_service` (gRPC messages both ways).
"""
