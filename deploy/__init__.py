"""The Mosquitto deployment kit: credentials, broker configuration and ACL of one fleet.

``python -m deploy`` (:mod:`deploy.__main__`) makes a fleet's lab CA, the broker's server
certificate, the coordinator's and each device's client certificate (the certificate's
CN is the MQTT user name), or per-device passwords, and writes a Mosquitto configuration
and ACL that confine each device to its own topics of that one fleet (docs/deploy.md).

Modules:
    settings   what ``init`` is given (kit.json); the flags' defaults
    kit        the kit folder: what ``init``, ``device`` and ``passwords`` write
    pki        keys and certificates (the ``cryptography`` library; pure, no files)
    passwords  Mosquitto's password-file format (PBKDF2-SHA512, ``$7$``)
    mosquitto  the configuration and ACL, rendered from the templates in mosquitto/
    files      writing files with the right modes, never replacing one by accident
    errors     the error classes

Importing this package imports nothing else: the command line can say which extra to
install (``edgefl[deploy]``) when ``cryptography`` is missing.
"""
