def test_create_and_get(client):
    r = client.request("CreateJob", name="a")
    assert r.status == "200 OK", r
    assert r.json == {"jobID": 1}
    r = client.request("GetJob", name="a")
    assert r.json["jobID"] == 1
